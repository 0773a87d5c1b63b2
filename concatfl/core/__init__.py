"""Pure algorithm cores: numpy/torch in, numpy/torch out, no Flower imports."""
