"""synkhronos._kept."""
