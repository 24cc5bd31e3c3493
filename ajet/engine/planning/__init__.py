"""Memory planning, importable without torch (the config validator runs it).

    memory_plan.py  will a job fit on its devices, and what would make it fit
    peak_memory.py  the measured peak memory each metrics line carries
"""
