"""Setting up a launch: the flags, the user's accelerate / DeepSpeed file and the batch rules settled into one
read-only run, and the checks that refuse what cannot work, all before the model loads (settle.py orders
them). Imports model and data below it."""
