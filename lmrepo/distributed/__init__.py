"""How ranks find each other and split the work: the device, launching and rendezvous, the one parallel
layout (mesh), tensor and sequence parallelism applied to a model, and gradient norms over the mesh."""
