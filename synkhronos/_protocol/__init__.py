"""synkhronos._protocol."""
