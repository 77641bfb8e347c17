"""Model loading, named model pairs and offline installation of real weights."""
