"""The scripted research agent behind `examples/research_loop.py` (what `make demo` runs).

It plays the part an LLM agent plays: every action on the cluster is an MCP tool call to
`ajet-mcp`, and the next call is chosen from what the previous results say (state,
`last_error`, log lines, the "Next: ..." of each message). Its parts:

- `console`: the lines the person running the demo reads;
- `agent`: the MCP session (every call recorded with its size), the approval paths, a
  training run, and the recovery from a crashed engine;
- `lab`: the throwaway repository, the hypotheses and the edits that test them;
- `judging`: run records, verdicts from the measured metric, the best run so far;
- `report`: the table, the plot of all runs and `demo_report.md`.
"""
