"""The bundled demos' data generators: the letters task of ``recipes/demo.yaml`` and the coloured
shapes of ``recipes/multimodal/shapes.yaml``. Each writes its data to files that training then
reads as it reads a user's; a task imports them only when its recipe asks for a
demo's data."""
