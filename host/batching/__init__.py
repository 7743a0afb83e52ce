"""Batching: the scheduler that merges every instance's forwards into backend calls, the
forward futures, the batching policies and the run gate. Import the modules directly."""
