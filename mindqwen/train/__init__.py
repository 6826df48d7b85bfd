"""Graph-mode training: precision policy, optimizer and schedules, step Cells, checkpoints, fit()."""
