"""What operators see: the access record, the measured series and their snapshot, SSE
metering (time to first token, gaps), the defence log and the core's statistics."""
