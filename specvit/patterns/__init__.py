"""Block patterns: functions that emit the nodes of a block from its spec."""
