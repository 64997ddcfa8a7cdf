"""Real Horovod jobs started with horovodrun or mpirun (marked ``multiproc``)."""
