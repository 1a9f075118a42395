"""Blending: segments and keys, reuse planning, token selection, the blender."""
