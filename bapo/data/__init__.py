"""Training and evaluation data: the dataset schema (``data`` group), loading rows from JSONL files and the
hub with per-row validation, and the procedurally generated tasks of the shipped testbeds."""
