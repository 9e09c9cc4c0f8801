"""The master-worker call protocol: the control block and reply areas, the
master's Session, synk.data by reference, distributing functions, the worker
loop; and the steps between node masters."""
