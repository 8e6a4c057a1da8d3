"""How ranks find each other and split the work: the device, launching and rendezvous, the one
parallel layout (mesh), and tensor and sequence parallelism applied to a model."""
