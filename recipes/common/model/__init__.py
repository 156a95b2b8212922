"""The model: read from its config without weights (the checks use it), loaded for the launch's strategy
(one stage's weights under pipeline parallel), adapted and compiled. Imports data's chat template below it."""
