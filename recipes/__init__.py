"""The bundled recipes, installed as the package data of ``mindqwen.recipes`` (``mindqwen recipes ls``)."""
