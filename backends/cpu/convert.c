/* convert: to be written */
