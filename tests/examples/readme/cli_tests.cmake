# The README's example (loom_example_tests: run in examples/readme's scope): the README still
# shows readme_example.cpp, and the program runs.
add_test(NAME readme_example_test COMMAND ${CMAKE_COMMAND} -DREADME=${PROJECT_SOURCE_DIR}/README.md
         -DSNIPPET=${CMAKE_CURRENT_SOURCE_DIR}/readme_example.cpp -DEXE=$<TARGET_FILE:loom-readme-example>
         -P ${CMAKE_CURRENT_SOURCE_DIR}/check_readme.cmake)
