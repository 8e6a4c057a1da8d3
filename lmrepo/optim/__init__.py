"""What updates the weights: the parameter groups and the optimizer every engine builds from them
(AdamW, Muon), Muon's role split and the learning-rate schedules."""
