"""Transport shared by the episode plane and the ranks: uvicorn on a Unix socket."""
