"""The domain, below everything and free of torch: errors and paths, the strict JSON reader
and canonical hashing, items, stage plans, answers and scoring, the sampler,
trajectories and their comparison, the power of a verdict, and what an install lacks."""
