"""Evaluation: ``eval.py``'s sets, sampling and grading, and the unbiased avg@k / pass@k estimators."""
