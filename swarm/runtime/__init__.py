"""The process runtime: the compute thread and its queue, OpenMP/thread tuning, CPU turns, memory trimming, typed
process configs."""
