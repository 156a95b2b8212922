"""What a run leaves: checkpoints and resume, the exported model or adapter, run.json and metrics, sample
generations and the model card. Imports launching, model and data below it (beside training, not above it)."""
