"""Worker and model runner: thin subclasses of upstream's GPU ones (as upstream's XPU ones are)."""
