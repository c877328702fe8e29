"""Rendering stage graphs as readable Python: forward bodies, operators, names, frees, generated classes and functions, the files of a build."""
