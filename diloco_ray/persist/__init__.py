"""What a run keeps: one file-system API for folders and buckets, the checkpoint format, snapshots, the run
folder and ``final/``.
"""
