"""SiLU-and-multiply of the SwiGLU MLP."""
