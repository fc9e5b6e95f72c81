# PYTHONPATH=.devrun/syncdebug:...: every implicit host<->device synchronisation warns (once per call site)
import torch
if torch.cuda.is_available():
    torch.cuda.set_sync_debug_mode("warn")
