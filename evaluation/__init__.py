"""Measuring drafters: online acceptance under greedy verification, and the offline estimate."""
