"""The question sets: BFCL simple (bfcl.py), a user's JSONL (jsonl.py), the recall test
(recall.py). Each returns a list of bench.eval.models.Question."""
