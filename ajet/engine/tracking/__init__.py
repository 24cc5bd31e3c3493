"""Experiment trackers: every step's metrics mirrored where researchers read curves.

    trackers.py   the job's `logging` value -> tracker names; which package each needs;
                  TensorBoard, W&B, MLflow and SwanLab writers; a set that turns a
                  failing tracker off for the run and lets training go on

The trackers run in the engine's rank 0, never in the swarm server. `metrics.jsonl`
stays the record the server serves; the trackers are copies of it.
"""
