"""Training and evaluation data: the dataset schema (``data`` group), the row mapping (``rows.py``), loading rows
from JSONL files (``loading.py``) and ``datasets`` sets (``hub.py``) with per-row validation, and the procedurally
generated tasks of the shipped testbeds."""
