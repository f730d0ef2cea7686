"""Measuring drafters: online acceptance (greedy or sampled verification) and the offline
estimate."""
