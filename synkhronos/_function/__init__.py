"""synkhronos._function."""
