"""`chatserve bench`: a load generator and latency benchmark over the real server (/ws or OpenAI SSE).

workloads (what to send) -> client (send one session, timestamp chunks) -> runner (closed / open loop)
-> metrics (pure arithmetic) -> report (JSON, tables); sweep (servers x concurrency), plots, baseline.
"""
