"""What a unit costs: shapes, FLOPs and bytes counted, times estimated or measured, device calibration, how costs scale with dynamic sizes, and tracing on the meta device."""
