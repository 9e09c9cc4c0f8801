"""synk.function: building a function, what every process holds of it, the
master's call, the worker's execution and the output reduction."""
