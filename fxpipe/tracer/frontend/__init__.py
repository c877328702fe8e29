"""The two front ends (torch.fx symbolic tracing, torch.export) and what brings their graphs to the normalized form: leaves, mutation, checks on data, models that fix their batch."""
