"""Running the training: the Accelerator for the launch and the step's one collective, pipeline parallel's
schedules, evaluation. Imports launching, model and data below it."""
