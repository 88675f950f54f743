"""What a run shows: typed events, round records, ``metrics.jsonl`` and trackers, Ray metrics, the console
progress and the report.
"""
