"""Where a job runs: its device (device.py), its seeds (seeding.py) and its GPU of a shared machine (gpu_slots.py).

Nothing here imports the rest of fedcore, so training, artifacts and probes can all use it without import circles.
"""
