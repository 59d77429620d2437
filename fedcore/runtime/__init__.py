"""Where and how a job runs: its device (device.py), its seeds (seeding.py), its GPU of a shared machine
(gpu_slots.py), its log across attempts (joblog.py) and its own CPU and wall time (jobtime.py).

Nothing here imports the rest of fedcore but fedcore/io.py, so training, artifacts, probes and the workflow's
scripts can all use it without import circles.
"""
