"""synkhronos._shareds."""
