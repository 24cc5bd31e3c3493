"""`python -m swarm_server` = `ajet-swarm`."""

from swarm_server.cli import main

raise SystemExit(main())
