"""sage2 attention: the kernel choice, the Triton, Gluon and CUDA C++ kernels, their custom op, quantisation and
the torch reference."""
