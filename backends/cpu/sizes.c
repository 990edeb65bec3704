/* sizes: to be written */
