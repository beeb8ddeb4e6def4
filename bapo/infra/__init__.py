"""What every layer uses and that imports nothing above it: config errors and checks, paths, torch.distributed,
seeding, the atomic checkpoint folder, and metric tracking (wandb and the local file)."""
