"""Evaluation: benchmark formats, pass@k, and the eval runner."""
