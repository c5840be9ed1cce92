"""Usage examples of bert_reduce (a package so that tests can import them)."""
