"""Is a build the model? The safety net at build time and `fxpipe verify`, both on one comparison rule."""
